"""Small helpers the notebooks use (tables and demos too long for a notebook cell)."""
