"""The torch-free engine core: config, requests, paged blocks, the scheduler, the cost model."""
