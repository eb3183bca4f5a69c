"""vlm_kv.gates"""
