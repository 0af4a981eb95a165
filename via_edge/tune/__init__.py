"""`via-edge tune`: cost profile, slim-layer search, offline replay and the tuned choice."""
