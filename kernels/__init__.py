"""vlm_kv.kernels"""
