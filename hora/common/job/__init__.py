"""The job a worker belongs to: where it runs, how it reaches the others, and the store they share.

See README.md in this folder for its modules. Nothing here knows tensors or the engine.
"""
