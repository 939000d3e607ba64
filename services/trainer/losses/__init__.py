"""Loss functions: small pure tensor functions, one module each."""
