"""Graph passes. `pipeline.py` is the ordered list; one small module per pass."""
