"""eviction"""
