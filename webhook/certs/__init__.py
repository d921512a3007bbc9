"""Certificates, by job:

- `issue`: making a CA and serving or client certificates, their PEM forms, the development pair;
- `context`: the server's TLS context, reloaded when the files change, and what it holds;
- `secret`: self-managed mode, the pair kept in a Secret (issued by the certificate controller) and the CA
  written into the caBundle.

`from webhook import certs` keeps offering the names its users had.
"""

from cryptography.hazmat.primitives import hashes  # noqa: F401  (callers sign their own certificates with it)

from .context import ReloadingContext
from .issue import (
                    CA_DAYS,
                    FILES,
                    SERVING_DAYS,
                    make_ca,
                    make_leaf,
                    pem_cert,
                    pem_key,
                    service_names,
                    write_dev_pair,
                    write_file,
)
from .secret import (
                    RENEW_BEFORE,
                    CertificateController,
                    SelfManaged,
                    ensure_secret,
                    inject_ca_bundle,
                    new_files,
                    usable,
                    write_served,
)

__all__ = ["CA_DAYS", "CertificateController", "FILES", "RENEW_BEFORE", "SERVING_DAYS", "ReloadingContext",
           "SelfManaged", "ensure_secret",
           "hashes", "inject_ca_bundle", "make_ca", "make_leaf", "new_files", "pem_cert", "pem_key", "service_names",
           "usable", "write_dev_pair", "write_file", "write_served"]
