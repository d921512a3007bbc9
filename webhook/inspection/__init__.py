"""What judges a live cluster: `audit`'s verdict on each runtime and TrainJob, the OpenReports it writes
(`reports`), and `verify`'s probes (`verify`, `verify_causes`, `verify_cleanup`, `verify_report`). Pure like the
core, which it builds on: these modules take what `webhook.kube` read and make no call themselves, and import
no adapter library; `tests/unit/test_layers.py` keeps them so."""
