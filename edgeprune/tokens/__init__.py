"""Training-free token merging (ToMe, Bolya et al., ICLR 2023) for timm ViTs, exportable with static shapes.

``merge`` -- bipartite soft matching and the size-weighted merge; ``attention`` -- proportional attention;
``model`` -- the merge block and the block sequence carrying token sizes; ``schedule`` -- r per block;
``apply`` -- a model merged in place. docs/tokens.md.
"""

from edgeprune.tokens.apply import apply_token_merge, check_mergeable, merge_plan, num_tokens
from edgeprune.tokens.merge import MergePlan, bipartite_soft_matching, merge_wavg, split_sizes
from edgeprune.tokens.model import MergedBlocks, TokenMergeBlock
from edgeprune.tokens.schedule import parse_tokens_merge, plan_merges, schedule_r, token_counts

__all__ = ["apply_token_merge", "check_mergeable", "merge_plan", "num_tokens", "MergePlan", "bipartite_soft_matching",
           "merge_wavg", "split_sizes", "MergedBlocks", "TokenMergeBlock", "parse_tokens_merge", "plan_merges",
           "schedule_r", "token_counts"]
