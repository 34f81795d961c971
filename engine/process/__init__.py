"""The engine-core process: ``core`` (an ``LLMEngine`` and its step loop, driven by commands),
``transport`` (a child process behind two pipes, or a thread behind two queues), ``client`` (the
server's one handle on it) and ``streams`` (each request's outputs to its asyncio queue)."""
