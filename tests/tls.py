"""TLS and raw HTTP/1.1 against a server on loopback: sockets, handshakes, responses read byte by byte, and
certificate rotation as a certificate controller does it."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from webhook import certs


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def tls_socket(base: str, ca: str) -> ssl.SSLSocket:
    """A verified TLS connection to the server at `base` (https://127.0.0.1:PORT)."""
    ctx = ssl.create_default_context(cafile=ca)
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port_of(base)), timeout=10),
                           server_hostname="127.0.0.1")


def handshake(base: str, ca: str, maximum: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED,
              ciphers: str | None = None, minimum: ssl.TLSVersion | None = None) -> str:
    """The TLS version a handshake with at most `maximum` (and `ciphers`) agrees on."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    if minimum is not None:
        ctx.minimum_version = minimum
    ctx.maximum_version = maximum
    if ciphers:
        ctx.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", port_of(base)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.version()


def read_response(sock: socket.socket, buffered: bytearray) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length, from `buffered` and then the socket."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a response"
        buffered += chunk
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    code = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        rest += chunk
    buffered[:] = rest[length:]
    return code, headers, rest[:length]


def rotate_serving(cert_dir: Path, names: list[str], days: int = certs.SERVING_DAYS) -> None:
    """A new serving pair from the CA already in `cert_dir`, written key first (as a rotation looks)."""
    ca_key = serialization.load_pem_private_key((cert_dir / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    key, cert = certs.make_leaf(ca_key, ca_cert, names, days=days)
    certs.write_file(cert_dir / "tls.key", certs.pem_key(key), True)
    certs.write_file(cert_dir / "tls.crt", certs.pem_cert(cert), False)
