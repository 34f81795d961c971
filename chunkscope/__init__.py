"""chunkscope: the `chunkscope` command (cli.py) sits here, above the packages it dispatches to."""
