"""Runtime: generated step functions, the signature cache, and the compiled-step object."""
