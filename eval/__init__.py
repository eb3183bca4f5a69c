"""vlm_kv.eval"""
