"""The certificates and keys of a throw-away control plane on loopback (the ``cryptography`` package).

One CA signs everything: the API server's serving certificate (127.0.0.1, localhost and the
in-cluster names), the client certificates of the admin (``system:masters``), the scheduler, the
controller-manager and the API server's kubelet client; a second CA is the front proxy's (the
aggregation layer's request-header authentication, which kube-apiserver wants configured). The
service-account signing key is an RSA key the API server verifies tokens with and the
controller-manager signs them with. Keys are written 0600 into a 0700 directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)  # a test cluster lives minutes; a day's clock skew is tolerated
BACKDATE = datetime.timedelta(hours=1)
SERVICE_IP = "10.0.0.1"  # the first address of --service-cluster-ip-range (the kubernetes Service)
API_SERVER_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local")
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Pair:
    """One certificate and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    """Every file a control plane's processes and its clients need."""

    directory: Path
    ca: Pair
    front_proxy_ca: Pair
    apiserver: Pair
    admin: Pair
    scheduler: Pair
    controller_manager: Pair
    kubelet_client: Pair
    front_proxy_client: Pair
    sa_key: Path  # RSA private key: the controller-manager's and the API server's signing key
    sa_pub: Path  # its public half: what the API server verifies tokens with

    def ca_pem(self) -> bytes:
        return self.ca.cert.read_bytes()


def _new_key() -> Key:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, mode: int = PRIVATE_FILE) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)


def _key_pem(key: Key | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    return x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _ca(cn: str) -> tuple[x509.Certificate, Key]:
    key = _new_key()
    name = _name(cn)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - BACKDATE).not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, Key], cn: str, *, orgs: tuple[str, ...] = (), server: bool = False,
    dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
) -> tuple[x509.Certificate, Key]:
    ca_cert, ca_key = ca
    key = _new_key()
    usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn, orgs)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - BACKDATE).not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if dns or ips:
        alt: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        alt += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def _save(directory: Path, stem: str, pair: tuple[x509.Certificate, Key]) -> Pair:
    cert, key = pair
    out = Pair(directory / f"{stem}.crt", directory / f"{stem}.key")
    _write(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(out.key, _key_pem(key))
    return out


def make_pki(directory: Path) -> ClusterPki:
    """Create every certificate and key of one control plane in ``directory`` (made 0700)."""
    directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    os.chmod(directory, PRIVATE_DIR)
    ca = _ca("vmfence-test-ca")
    fp_ca = _ca("vmfence-test-front-proxy-ca")
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    _write(sa_key, _key_pem(sa))
    _write(sa_pub, sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)
    return ClusterPki(
        directory=directory,
        ca=_save(directory, "ca", ca),
        front_proxy_ca=_save(directory, "front-proxy-ca", fp_ca),
        apiserver=_save(directory, "apiserver", _leaf(ca, "kube-apiserver", server=True, dns=API_SERVER_NAMES,
                                                      ips=("127.0.0.1", SERVICE_IP))),
        admin=_save(directory, "admin", _leaf(ca, "vmfence-admin", orgs=("system:masters",))),
        scheduler=_save(directory, "scheduler", _leaf(ca, "system:kube-scheduler")),
        controller_manager=_save(directory, "controller-manager", _leaf(ca, "system:kube-controller-manager")),
        kubelet_client=_save(directory, "apiserver-kubelet-client",
                             _leaf(ca, "kube-apiserver-kubelet-client", orgs=("kubeadm:cluster-admins",))),
        front_proxy_client=_save(directory, "front-proxy-client", _leaf(fp_ca, "front-proxy-client")),
        sa_key=sa_key,
        sa_pub=sa_pub,
    )
