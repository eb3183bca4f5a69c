"""vlm_kv.train"""
