"""vlm-kv: compressed KV caches for vision-language models on stock transformers.

    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.1)
    model.generate(**inputs, cache=cache)
"""

from vlm_kv.api import attach, make_cache
from vlm_kv.attention.handoff import AttentionBypassError
from vlm_kv.config import Budget, BudgetError, CacheOptions, TierConfig
from vlm_kv.cache.cache import CacheMisuseError, CompressedCache
from vlm_kv.models.named import load_model, load_vlm
from vlm_kv.policies import POLICIES

__all__ = ["make_cache", "attach", "Budget", "BudgetError", "CacheOptions", "TierConfig", "CompressedCache", "CacheMisuseError", "AttentionBypassError", "POLICIES",
           "load_model", "load_vlm"]
__version__ = "0.1.0"
