"""``horarun`` and ``hora.run``: host parsing, slot assignment, process spawning and supervision,
and the job's rendezvous store. Importing this package never imports PyTorch.
"""
