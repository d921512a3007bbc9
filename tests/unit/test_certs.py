"""Certificates: the checks behind self-managed renewal, and the reloading TLS context."""

import datetime as dt
import os
import ssl

from cryptography import x509

from webhook import certs

NAMES = certs.service_names("dispatch-admission", "dispatch-system")


def files(names=NAMES, days=certs.SERVING_DAYS):
    ca_key, ca = certs.make_ca()
    key, leaf = certs.make_leaf(ca_key, ca, names, days=days)
    return {"ca.crt": certs.pem_cert(ca), "ca.key": certs.pem_key(ca_key),
            "tls.crt": certs.pem_cert(leaf), "tls.key": certs.pem_key(key)}


def test_a_fresh_pair_is_usable():
    assert certs.usable(files(), NAMES)


def test_renewal_is_due_30_days_before_expiry():
    assert not certs.usable(files(days=29), NAMES)
    assert certs.usable(files(days=31), NAMES)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=certs.SERVING_DAYS - 20)
    assert not certs.usable(files(), NAMES, now=later)


def test_missing_mismatched_or_uncovering_pairs_are_not_usable():
    good = files()
    assert not certs.usable({k: v for k, v in good.items() if k != "tls.key"}, NAMES)
    assert not certs.usable({**good, "tls.key": files()["tls.key"]}, NAMES), "key of another pair"
    assert not certs.usable({**good, "ca.crt": files()["ca.crt"]}, NAMES), "signed by another CA"
    assert not certs.usable(files(names=["localhost"]), NAMES), "does not cover the Service names"
    assert not certs.usable({**good, "tls.crt": b"not a certificate"}, NAMES)


def test_renewal_keeps_a_ca_with_time_left_and_replaces_one_without():
    old = files(days=10)
    renewed = certs._new_files(old, NAMES)
    assert renewed["ca.crt"] == old["ca.crt"] and renewed["tls.crt"] != old["tls.crt"]
    assert certs.usable(renewed, NAMES)
    assert certs._new_files({}, NAMES)["ca.crt"] != old["ca.crt"]


def test_write_served_reports_changes_only(tmp_path):
    pair = files()
    assert certs.write_served(tmp_path, pair) is True
    assert certs.write_served(tmp_path, pair) is False
    assert oct(os.stat(tmp_path / "tls.key").st_mode & 0o777) == "0o600"


def test_reloading_context_swaps_on_change_and_keeps_the_old_on_a_bad_pair(tmp_path):
    certs.write_dev_pair(tmp_path, ["localhost"])
    ctx = certs.ReloadingContext(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    first = ctx.get()
    assert first.minimum_version == ssl.TLSVersion.TLSv1_2
    ctx._checked = 0
    assert ctx.get() is first, "unchanged files keep the context"
    (tmp_path / "tls.crt").write_bytes(files()["tls.crt"])  # mid-rotation: the key does not match yet
    ctx._checked = 0
    assert ctx.get() is first
    certs.renew_serving(tmp_path, ["localhost"])
    ctx._checked = 0
    assert ctx.get() is not first
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    assert leaf.issuer == x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes()).subject
