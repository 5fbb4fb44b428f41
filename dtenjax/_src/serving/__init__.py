"""The latency-bound micro-batch scheduler over compiled steps.
"""
