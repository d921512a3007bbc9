"""Certificates: the checks behind self-managed renewal, and the reloading TLS context."""

import datetime as dt
import os
import ssl
import time

import pytest
from cryptography import x509

from tests.tls import rotate_serving
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
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=certs.SERVING_DAYS - 20)
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
    renewed = certs.new_files(old, NAMES)
    assert renewed["ca.crt"] == old["ca.crt"] and renewed["tls.crt"] != old["tls.crt"]
    assert certs.usable(renewed, NAMES)
    assert certs.new_files({}, NAMES)["ca.crt"] != old["ca.crt"]


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
    rotate_serving(tmp_path, ["localhost"])
    ctx._checked = 0
    assert ctx.get() is not first
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    assert leaf.issuer == x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes()).subject


def _context(tmp_path, days=certs.SERVING_DAYS, clock=time.time):
    certs.write_dev_pair(tmp_path, ["localhost"])
    if days != certs.SERVING_DAYS:
        rotate_serving(tmp_path, ["localhost"], days=days)
    return certs.ReloadingContext(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"),
                                  cafile=str(tmp_path / "ca.crt"), clock=clock)


def test_readiness_follows_the_held_certificate_validity(tmp_path):
    """/readyz's certificate check: a pair that loaded and is inside its validity period."""
    now = [time.time()]
    ctx = _context(tmp_path, clock=lambda: now[0])
    assert ctx.valid()
    now[0] = ctx.not_after + 1
    assert not ctx.valid(), "an expired certificate is not a loaded one"
    now[0] = ctx.not_before - 1
    assert not ctx.valid(), "nor one not valid yet"


def test_an_expired_pair_on_disk_is_not_ready_and_a_renewed_one_is(tmp_path):
    later = time.time() + 2 * 86400
    ctx = _context(tmp_path, days=1, clock=lambda: later)  # expired by then
    assert not ctx.valid()
    rotate_serving(tmp_path, ["localhost"])
    ctx._checked = 0
    assert ctx.valid()


def test_removed_files_keep_the_held_pair(tmp_path):
    ctx = _context(tmp_path)
    held = ctx.get()
    (tmp_path / "tls.crt").unlink()
    (tmp_path / "tls.key").write_bytes(b"garbage")
    ctx._checked = 0
    assert ctx.get() is held and ctx.valid()


def test_expiry_reports_the_serving_and_ca_certificates(tmp_path):
    ctx = _context(tmp_path)
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    assert ctx.expiry() == {"serving": leaf.not_valid_after_utc.timestamp(), "ca": ca.not_valid_after_utc.timestamp()}
    (tmp_path / "ca.crt").unlink()
    ctx._checked = 0
    assert set(ctx.expiry()) == {"serving"}


def test_a_changed_client_ca_is_reloaded(tmp_path):
    certs.write_dev_pair(tmp_path, ["localhost"])
    client_ca = tmp_path / "client-ca.crt"
    client_ca.write_bytes(certs.pem_cert(certs.make_ca("one")[1]))
    ctx = certs.ReloadingContext(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(client_ca))
    first = ctx.get()
    assert first.verify_mode == ssl.CERT_REQUIRED
    time.sleep(0.01)
    client_ca.write_bytes(certs.pem_cert(certs.make_ca("two")[1]))
    ctx._checked = 0
    second = ctx.get()
    assert second is not first
    assert [c["subject"] for c in second.get_ca_certs()] == [((("commonName", "two"),),)]


class _FakeAdmissionApi:
    """AdmissionregistrationV1Api's four calls inject_ca_bundle makes, over dicts of configurations."""

    def __init__(self, mutating: dict, validating: dict):
        from types import SimpleNamespace

        self.ns = SimpleNamespace
        self.stored = {"mutating": mutating, "validating": validating}
        self.patched: list[tuple[str, str]] = []

    def _read(self, kind, name):
        from kubernetes.client.exceptions import ApiException

        if name not in self.stored[kind]:
            raise ApiException(status=404, reason="Not Found")
        hooks = [self.ns(client_config=self.ns(ca_bundle=b)) for b in self.stored[kind][name]]
        return self.ns(webhooks=hooks)

    def _patch(self, kind, name, ops):
        for op in ops:
            index = int(op["path"].split("/")[2])
            self.stored[kind][name][index] = op["value"]
        self.patched.append((kind, name))

    def read_mutating_webhook_configuration(self, name):
        return self._read("mutating", name)

    def read_validating_webhook_configuration(self, name):
        return self._read("validating", name)

    def patch_mutating_webhook_configuration(self, name, ops):
        self._patch("mutating", name, ops)

    def patch_validating_webhook_configuration(self, name, ops):
        self._patch("validating", name, ops)


def _inject(monkeypatch, fake, ca=b"CA PEM"):
    from kubernetes import client

    monkeypatch.setattr(client, "AdmissionregistrationV1Api", lambda api_client: fake)
    return certs.inject_ca_bundle(object(), "rel-dispatch-admission", ca)


def test_the_ca_reaches_the_runtime_warnings_configuration_too(monkeypatch):
    import base64

    fake = _FakeAdmissionApi({"rel-dispatch-admission": [None]},
                             {"rel-dispatch-admission": [None], "rel-dispatch-admission-runtimes": [None],
                              "other-runtimes": [None]})
    assert _inject(monkeypatch, fake) == 3
    bundle = base64.b64encode(b"CA PEM").decode()
    assert fake.stored["validating"]["rel-dispatch-admission-runtimes"] == [bundle]
    assert fake.stored["validating"]["other-runtimes"] == [None]
    assert _inject(monkeypatch, fake) == 0, "nothing patched when every bundle is already the CA"


def test_no_runtime_warnings_configuration_is_not_an_error(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    fake = _FakeAdmissionApi({"rel-dispatch-admission": [None]}, {"rel-dispatch-admission": [None, None]})
    assert _inject(monkeypatch, fake) == 3
    assert fake.patched == [("mutating", "rel-dispatch-admission"), ("validating", "rel-dispatch-admission")]
    forbidden = _FakeAdmissionApi({"rel-dispatch-admission": [None]}, {"rel-dispatch-admission": [None]})
    forbidden._read_any = forbidden._read

    def read_forbidding_runtimes(kind, name):
        if name.endswith("-runtimes"):  # the chart's ClusterRole names it only when it renders it
            raise ApiException(status=403, reason="Forbidden")
        return forbidden._read_any(kind, name)

    forbidden._read = read_forbidding_runtimes
    assert _inject(monkeypatch, forbidden) == 2
    missing = _FakeAdmissionApi({}, {"rel-dispatch-admission": [None]})
    try:
        _inject(monkeypatch, missing)
    except ApiException as e:
        assert e.status == 404  # the main configurations are required
    else:
        raise AssertionError("a missing mutating configuration went unnoticed")


class _Clock:
    def __init__(self):
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def _keeper(monkeypatch, tmp_path, secret: dict):
    """A SelfManaged over a Secret held in `secret["files"]`; the caBundles it writes are recorded, each with
    what was being served from the directory at that moment."""
    from webhook.certs import secret as secret_mod

    clock = _Clock()
    bundles: list[tuple[bytes, bytes | None]] = []
    monkeypatch.setattr(secret_mod, "ensure_secret", lambda api, ns, name, names: secret["files"])

    def inject(api, configuration, ca_pem):
        served = tmp_path / "ca.crt"
        bundles.append((ca_pem, served.read_bytes() if served.exists() else None))
        return 1

    monkeypatch.setattr(secret_mod, "inject_ca_bundle", inject)
    keeper = certs.SelfManaged(object(), "ns", "rel-tls", NAMES, tmp_path, "rel", clock=clock, sleep=clock.sleep)
    return keeper, clock, bundles


def test_a_new_ca_is_trusted_beside_the_old_before_it_is_served_then_the_old_leaves(monkeypatch, tmp_path):
    first, second = files(), files()
    secret = {"files": first}
    keeper, clock, bundles = _keeper(monkeypatch, tmp_path, secret)
    assert keeper.sync() is True
    assert bundles == [(first["ca.crt"], first["ca.crt"])] and clock.slept == []
    assert keeper.sync() is False, "nothing changes while the Secret does not"

    bundles.clear()
    secret["files"] = second  # the Secret deleted and re-issued by another replica: a new CA
    assert keeper.sync() is True
    widened, served = bundles[0]
    assert widened == second["ca.crt"] + first["ca.crt"] and served == first["ca.crt"], \
        "both CAs are trusted while this replica still serves the old pair"
    assert clock.slept == [certs.secret.SETTLE_SECONDS]
    assert (tmp_path / "tls.crt").read_bytes() == second["tls.crt"]
    assert bundles[-1][0] == second["ca.crt"] + first["ca.crt"], "the old CA stays for the other replicas"

    clock.now += certs.secret.TRUST_REPLACED_CA_SECONDS - certs.secret.SETTLE_SECONDS - 1
    keeper.sync()
    assert bundles[-1][0] == second["ca.crt"] + first["ca.crt"]
    clock.now += 1
    keeper.sync()
    assert bundles[-1][0] == second["ca.crt"], "the replaced CA leaves the bundle"


def test_a_new_serving_pair_under_the_same_ca_keeps_the_bundle(monkeypatch, tmp_path):
    first = files()
    secret = {"files": first}
    keeper, clock, bundles = _keeper(monkeypatch, tmp_path, secret)
    keeper.sync()
    renewed = certs.new_files(first, NAMES)  # a renewal keeps a CA with time left
    assert renewed["ca.crt"] == first["ca.crt"]
    secret["files"] = renewed
    assert keeper.sync() is True
    assert [b for b, _ in bundles] == [first["ca.crt"], first["ca.crt"]] and clock.slept == []


# ---- the certificate controller (issue 25: the serving pods only read the Secret; issue 35: the CA apart) ----

CA_KEYS = {"ca.crt", "ca.key"}
SERVING_KEYS = {"ca.crt", "tls.crt", "tls.key"}


def split(all_files: dict) -> tuple[dict, dict]:
    """(the CA Secret's files, the serving Secret's) of one pair."""
    return ({k: all_files[k] for k in CA_KEYS}, {k: all_files[k] for k in SERVING_KEYS})


class _ControllerWorld:
    """The two Secrets (by name: rel-ca, rel-tls) and the caBundle the controller reads and writes, with a log
    of what happened in which order."""

    def __init__(self, monkeypatch, secrets: dict | None = None, bundle=()):
        from webhook.certs import secret as secret_mod

        self.secrets: dict[str, dict] = {k: dict(v) for k, v in (secrets or {}).items()}
        self.bundle: list[bytes] = list(bundle)
        self.events: list[tuple] = []
        monkeypatch.setattr(secret_mod, "read_secret", lambda api, ns, name: (
            (self.ns(data=None), dict(self.secrets[name])) if name in self.secrets else (None, {})))
        monkeypatch.setattr(secret_mod, "trusted_cas", lambda api, conf: list(self.bundle))

        def inject(api, conf, pem):
            self.bundle = [m.encode() for m in
                           __import__("re").findall(r"-----BEGIN CERTIFICATE-----\n.+?\n-----END CERTIFICATE-----\n",
                                                    pem.decode(), __import__("re").S)]
            self.events.append(("bundle", tuple(self.bundle)))
            return 1

        monkeypatch.setattr(secret_mod, "inject_ca_bundle", inject)

        class Core:
            def create_namespaced_secret(core, ns, body):
                self._store(body.metadata.name, body.data)

            def replace_namespaced_secret(core, name, ns, body):
                self._store(name, body.data)

        from kubernetes import client
        monkeypatch.setattr(client, "CoreV1Api", lambda api: Core())

    @staticmethod
    def ns(**kw):
        from types import SimpleNamespace
        return SimpleNamespace(**kw)

    def _store(self, name, data):
        import base64
        self.secrets[name] = {k: base64.b64decode(v) for k, v in data.items()}
        self.events.append((name, self.secrets[name]["ca.crt"]))

    @property
    def served(self) -> dict:
        return self.secrets["rel-tls"]


def _controller(clock):
    return certs.CertificateController(object(), "ns", "rel-tls", NAMES, "rel", "rel-ca", clock=clock,
                                       sleep=clock.sleep)


def test_the_controller_fills_empty_secrets_the_ca_key_apart_after_the_bundle_trusts_its_ca(monkeypatch):
    world, clock = _ControllerWorld(monkeypatch), _Clock()
    assert _controller(clock).sync() is True
    assert set(world.secrets["rel-ca"]) == CA_KEYS
    assert set(world.served) == SERVING_KEYS, "the serving pods' Secret holds no CA key"
    ca = world.served["ca.crt"]
    assert world.secrets["rel-ca"]["ca.crt"] == ca and certs.usable({**world.served, **world.secrets["rel-ca"]}, NAMES)
    assert world.events.index(("bundle", (ca,))) < world.events.index(("rel-tls", ca)), "trusted before written"
    assert clock.slept == [certs.secret.SETTLE_SECONDS]
    assert _controller(clock).sync() is False, "nothing to do the next time"


def test_the_ca_key_of_an_install_from_before_the_split_moves_to_its_own_secret(monkeypatch):
    """The serving Secret held all four files: the CA goes to the CA Secret, the serving Secret is rewritten without
    its key, and the pods keep serving the same pair (no new CA, no new certificate)."""
    old = files()
    world, clock = _ControllerWorld(monkeypatch, {"rel-tls": old}, [old["ca.crt"]]), _Clock()
    assert _controller(clock).sync() is True
    assert world.secrets["rel-ca"] == {k: old[k] for k in CA_KEYS}
    assert world.served == {k: old[k] for k in SERVING_KEYS}
    assert world.bundle == [old["ca.crt"]] and clock.slept == []


def test_a_deleted_ca_secret_rotates_the_ca_trusted_beside_the_old_until_the_pods_switched(monkeypatch):
    """The rotation after an incident (and the install test's), as the controller sees it: the pods still serve the
    old pair, so the old CA stays trusted; the new one is trusted before the Secret carries it; the old leaves
    after the window."""
    ca_files, served = split(files())
    old_ca = ca_files["ca.crt"]
    world = _ControllerWorld(monkeypatch, {"rel-ca": ca_files, "rel-tls": served}, [old_ca])
    clock = _Clock()
    controller = _controller(clock)
    assert controller.sync() is False and world.bundle == [old_ca]
    del world.secrets["rel-ca"], world.secrets["rel-tls"]  # kubectl delete secret rel-ca rel-tls
    assert controller.sync() is True
    new_ca = world.served["ca.crt"]
    assert new_ca != old_ca and world.secrets["rel-ca"]["ca.crt"] == new_ca and set(world.served) == SERVING_KEYS
    widened = world.events.index(("bundle", (new_ca, old_ca)))
    assert widened < world.events.index(("rel-tls", new_ca))
    assert world.bundle == [new_ca, old_ca]
    clock.now += certs.secret.TRUST_REPLACED_CA_SECONDS - 1
    controller.sync()
    assert world.bundle == [new_ca, old_ca], "kept while a pod may still serve the old pair"
    clock.now += 1
    controller.sync()
    assert world.bundle == [new_ca], "then the old CA leaves"


def test_the_ca_secret_alone_deleted_rotates_the_serving_pair_too(monkeypatch):
    ca_files, served = split(files())
    world = _ControllerWorld(monkeypatch, {"rel-tls": served}, [served["ca.crt"]])
    assert _controller(_Clock()).sync() is True
    assert world.served["ca.crt"] == world.secrets["rel-ca"]["ca.crt"] != served["ca.crt"]
    assert world.served["tls.crt"] != served["tls.crt"], "a pair under the old CA is not kept"


def test_a_serving_secret_deleted_gets_a_new_pair_under_the_same_ca(monkeypatch):
    ca_files, served = split(files())
    world, clock = _ControllerWorld(monkeypatch, {"rel-ca": ca_files}, [ca_files["ca.crt"]]), _Clock()
    assert _controller(clock).sync() is True
    assert world.served["ca.crt"] == ca_files["ca.crt"] and world.secrets["rel-ca"] == ca_files
    assert world.bundle == [ca_files["ca.crt"]] and clock.slept == []


def test_a_renewal_under_the_same_ca_leaves_the_bundle_alone(monkeypatch):
    ca_files, near = split(files(days=10))  # inside RENEW_BEFORE: renewed, under the same CA
    world = _ControllerWorld(monkeypatch, {"rel-ca": ca_files, "rel-tls": near}, [near["ca.crt"]])
    clock = _Clock()
    assert _controller(clock).sync() is True
    assert world.served["ca.crt"] == near["ca.crt"] and world.served["tls.crt"] != near["tls.crt"]
    assert world.bundle == [near["ca.crt"]] and clock.slept == []


def test_a_ca_issues_only_with_its_own_key_and_while_it_outlives_a_serving_pair():
    ca_key, ca = certs.make_ca()
    assert certs.secret.issuing_ca({"ca.crt": certs.pem_cert(ca), "ca.key": certs.pem_key(ca_key)}) is not None
    other_key, _ = certs.make_ca()
    assert certs.secret.issuing_ca({"ca.crt": certs.pem_cert(ca), "ca.key": certs.pem_key(other_key)}) is None
    assert certs.secret.issuing_ca({"ca.crt": certs.pem_cert(ca)}) is None
    now = dt.datetime.now(dt.UTC)
    short = (x509.CertificateBuilder().subject_name(ca.subject).issuer_name(ca.subject)
             .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(now + dt.timedelta(days=certs.SERVING_DAYS - 1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
             .sign(ca_key, certs.hashes.SHA256()))
    assert certs.secret.issuing_ca({"ca.crt": certs.pem_cert(short), "ca.key": certs.pem_key(ca_key)}) is None


def test_serve_read_only_waits_for_the_controller_and_never_writes(monkeypatch, tmp_path):
    from webhook.certs import secret as secret_mod

    issued, reads = files(), []

    def read(api, ns, name):
        reads.append(name)
        return (None, {}) if len(reads) < 3 else (object(), issued)

    monkeypatch.setattr(secret_mod, "read_secret", read)
    monkeypatch.setattr(secret_mod, "ensure_secret", lambda *a: (_ for _ in ()).throw(AssertionError("wrote")))
    monkeypatch.setattr(secret_mod, "inject_ca_bundle", lambda *a: (_ for _ in ()).throw(AssertionError("patched")))
    clock = _Clock()
    keeper = certs.SelfManaged(object(), "ns", "rel-tls", NAMES, tmp_path, None, clock=clock, sleep=clock.sleep,
                               read_only=True)
    assert keeper.sync() is True and (tmp_path / "tls.crt").read_bytes() == issued["tls.crt"]
    assert clock.slept == [1.0, 1.0]
    monkeypatch.setattr(secret_mod, "read_secret", lambda api, ns, name: (None, {}))  # deleted: keep serving
    assert keeper.sync() is False and (tmp_path / "tls.crt").read_bytes() == issued["tls.crt"]


def test_serve_read_only_gives_up_with_a_message_when_no_pair_comes(monkeypatch, tmp_path):
    from webhook.certs import secret as secret_mod

    monkeypatch.setattr(secret_mod, "read_secret", lambda api, ns, name: (None, {}))
    clock = _Clock()
    keeper = certs.SelfManaged(object(), "ns", "rel-tls", NAMES, tmp_path, None, clock=clock, sleep=clock.sleep,
                               read_only=True)
    with pytest.raises(RuntimeError, match="the certificate controller fills it"):
        keeper.sync()
