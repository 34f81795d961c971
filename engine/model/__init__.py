"""Model code: the Llama-family decoder, presets, weight loading (torch lives here)."""
