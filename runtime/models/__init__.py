"""Model implementations (the Llama family)."""
