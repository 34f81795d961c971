"""chunkscope: a chunked-prefill serving engine you can watch and steer, and bridges to others."""
