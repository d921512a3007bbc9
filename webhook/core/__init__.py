"""The pure core: settings, paths, image references, the error table, the rules, the mutation and the
admission decision. No I/O and no adapter library (Flask, gunicorn, the Kubernetes client) is imported
here; `tests/unit/test_layers.py` keeps it so."""
