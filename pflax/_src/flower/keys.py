"""The credentials of a Flower federation with TLS and node authentication (`LocalFederation`, and the
cross-machine commands of docs/flower.md): a private certificate authority, a TLS
certificate of the SuperLink signed by it, and SuperNode key pairs.

Every file is written with mode 0600 into a directory of mode 0700, made with
the `cryptography` library (a dependency of Flower). A SuperNode proves its
identity with its private key (OpenSSH format, EC P-384, a NIST curve as Flower
requires); its public key is registered with the SuperLink (`flwr supernode
register`) before it connects.
"""

import datetime
import ipaddress
import os
from collections.abc import Sequence
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_DAYS = 30


class Certificates(NamedTuple):
  """Paths of the PEM files of a SuperLink's TLS: `ca` (the root certificate
  every client trusts: `--root-certificates`, `root-certificates`), and the
  server's `cert` and `key` (`--ssl-certfile`, `--ssl-keyfile`)."""
  ca: str
  cert: str
  key: str


class NodeKey(NamedTuple):
  """Paths of a SuperNode's key pair in OpenSSH format: `private`
  (`flower-supernode --auth-supernode-private-key`) and `public` (`flwr supernode
  register`)."""
  private: str
  public: str


def private_directory(path: str) -> str:
  """Makes `path` (and its parents) with mode 0700 for the final one; returns it."""
  os.makedirs(path, mode=0o700, exist_ok=True)
  os.chmod(path, 0o700)
  return path


def _write(path: str, data: bytes) -> str:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
  return key.private_bytes(serialization.Encoding.PEM,
                           serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def _certificate(subject: str, public_key, issuer: str, signer,
                 extensions: Sequence[tuple[x509.ExtensionType, bool]]) -> bytes:
  now = datetime.datetime.now(datetime.timezone.utc)
  name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
  builder = (x509.CertificateBuilder().subject_name(name(subject))
             .issuer_name(name(issuer)).public_key(public_key)
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=_DAYS)))
  for extension, critical in extensions:
    builder = builder.add_extension(extension, critical)
  return builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def write_certificates(directory: str,
                       hosts: Sequence[str] = ("127.0.0.1", "localhost")
                       ) -> Certificates:
  """Writes a new certificate authority and a server certificate signed by it,
  valid for `hosts` (IP addresses or DNS names) for 30 days, into `directory`
  (made private, mode 0700).

  Example:
    >>> import tempfile
    >>> paths = write_certificates(tempfile.mkdtemp())
    >>> sorted(os.path.basename(p) for p in paths)
    ['ca.pem', 'server.key', 'server.pem']
  """
  private_directory(directory)
  ca_key = ec.generate_private_key(ec.SECP384R1())
  ca_name = f"pflax federation CA {os.urandom(4).hex()}"
  ca = _certificate(ca_name, ca_key.public_key(), ca_name, ca_key, [
      (x509.BasicConstraints(ca=True, path_length=0), True),
      (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                     content_commitment=False, key_encipherment=False,
                     data_encipherment=False, key_agreement=False,
                     encipher_only=False, decipher_only=False), True)])
  server_key = ec.generate_private_key(ec.SECP384R1())
  names = []
  for host in hosts:
    try:
      names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
      names.append(x509.DNSName(host))
  server = _certificate(hosts[0], server_key.public_key(), ca_name, ca_key, [
      (x509.BasicConstraints(ca=False, path_length=None), True),
      (x509.SubjectAlternativeName(names), False),
      (x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)])
  join = lambda name: os.path.join(directory, name)
  return Certificates(_write(join("ca.pem"), ca), _write(join("server.pem"), server),
                      _write(join("server.key"), _pem_key(server_key)))


def write_node_key(directory: str, name: str) -> NodeKey:
  """Writes a new SuperNode key pair `NAME` and `NAME.pub` into `directory`
  (made private, mode 0700)."""
  private_directory(directory)
  key = ec.generate_private_key(ec.SECP384R1())
  private = key.private_bytes(serialization.Encoding.PEM,
                              serialization.PrivateFormat.OpenSSH,
                              serialization.NoEncryption())
  public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH)
  path = os.path.join(directory, name)
  return NodeKey(_write(path, private), _write(path + ".pub", public + b"\n"))
