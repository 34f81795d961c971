"""chunkscope: the `chunkscope` command (cli.py) above the packages it dispatches to, and the
bridges to other engines (integrations/)."""
