"""Object storage: a path that is a URL (`s3://bucket/prefix`, or any other fsspec protocol) is read
through fsspec; a local path never comes here (memory maps and plain files stay as fast as they were).

Credentials are never part of dtrain's config: they come from where the store's own client looks (for
S3, boto's environment variables `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_ENDPOINT_URL`,
`~/.aws/config`, an instance role), so `config.toml`, the console and the logs hold only the URL.

fsspec (which torch already installs) and s3fs (the `s3` extra) are imported only when a URL is used.
Shared by every stage that reads or writes a URL (token data today; run.dir's checkpoints next).

The write side: an object store has no rename and no append, but one PUT is atomic (a reader sees the
whole old object or the whole new one), so `write_bytes` is what `files.atomic_write_text` is for a
local path. Its conditional forms (`if_absent`, `if_etag`: S3's If-None-Match / If-Match) are what a
lease is taken and renewed with: of two writers racing, exactly one wins, the other gets `Conflict`.
"""

from __future__ import annotations

import re
from typing import Any

from dtrain.errors import DtrainError

# What installs the S3 protocol: said whenever an s3:// URL finds s3fs missing.
S3_EXTRA = "pip install 'dtrain[s3]'"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class StorageError(DtrainError):
    """An object store that refuses the URL, its bucket or the credentials, or a protocol not installed."""


class Conflict(StorageError):
    """A conditional write lost: the object exists (`if_absent`) or changed since it was read (`if_etag`)."""


def is_url(path: object) -> bool:
    """Whether `path` names object storage (`scheme://...`) rather than a local path."""
    return isinstance(path, str) and bool(_URL.match(path))


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def credentials_in(url: str) -> bool:
    """Whether a URL carries a password (`scheme://user:secret@host/...`), which would then be written
    into config.toml and every log line that quotes the URL. A secret holding '/' (S3's often do) ends
    the URL's host early (`s3://KEY:SE/CRET@bucket`): a ':' in the host with an '@' after it counts too
    (no bucket name holds ':')."""
    if not is_url(url):
        return False
    rest = url.split("://", 1)[1]
    host = rest.split("/", 1)[0]
    return ("@" in host and ":" in host.split("@", 1)[0]) or (":" in host and "@" in rest)


def without_credentials(url: str) -> str:
    """The URL with its user and password left out: what may be shown."""
    if not credentials_in(url):
        return url
    return url.split("://", 1)[0] + "://" + url.split("://", 1)[1].split("@", 1)[1]


def join(url: str, name: str) -> str:
    """`url/name`: an object's URL under a prefix."""
    return url.rstrip("/") + "/" + name


def filesystem(url: str, key: str) -> tuple[Any, str]:
    """(fsspec filesystem, its path for `url`) for the config key `key` that names the URL; a protocol
    whose package is missing is one line naming what installs it."""
    import fsspec  # here, not at import: local runs never load it

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        how = S3_EXTRA if protocol(url) in ("s3", "s3a") else str(exc).rstrip(".")  # fsspec names the package
        raise StorageError(
            f"{key} = '{url}' needs the {protocol(url)}:// protocol, which is not installed; {how}"
        ) from None
    except ValueError as exc:  # fsspec's "Protocol not known"
        raise StorageError(
            f"{key} = '{url}': {exc}; use a local path or a URL fsspec knows (s3://bucket/prefix)"
        ) from None
    return fs, path


def bucket_of(path: str) -> str:
    """The bucket (container) of a filesystem path: its first component."""
    return path.split("/", 1)[0]


def refusal(exc: BaseException, url: str, key: str, fs: Any = None, path: str = "") -> StorageError | None:
    """The one line for a store's refusal of `url` (a missing bucket, credentials it does not take,
    none found, a store that does not answer), or None for an error that is none of these."""
    name = type(exc).__name__
    fix = "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile) and AWS_ENDPOINT_URL for this store"
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StorageError(f"{key} = '{url}': no credentials for the store were found; {fix}")
    if isinstance(exc, PermissionError):
        return StorageError(f"{key} = '{url}': the store refused these credentials ({_first_line(exc)}); {fix}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or isinstance(
        exc, ConnectionError
    ):
        return StorageError(
            f"{key} = '{url}': the store does not answer ({_first_line(exc)}); check AWS_ENDPOINT_URL and the network"
        )
    if isinstance(exc, ValueError) or name == "ParamValidationError":  # a bucket name the client refuses
        said = str(exc).strip().splitlines()[-1].split(": ")[0] if str(exc).strip() else name
        return StorageError(f"{key} = '{url}' is not a usable URL ({said}); e.g. s3://bucket/prefix")
    if isinstance(exc, FileNotFoundError) and fs is not None and path and not _exists(fs, bucket_of(path)):
        return StorageError(
            f"{key} = '{url}': bucket '{bucket_of(path)}' does not exist (or these credentials cannot see it); "
            f"create it, or name an existing one"
        )
    return None


def _exists(fs: Any, path: str) -> bool:
    try:
        return bool(fs.exists(path))
    except Exception:  # a store that cannot say: the caller's own message stands
        return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _conditions(url: str, if_absent: bool, if_etag: str | None) -> dict[str, str]:
    """The PUT's preconditions, as s3fs passes them to S3; refused for a protocol that has none (a
    lease on it could be taken twice)."""
    if not (if_absent or if_etag):
        return {}
    if protocol(url) not in ("s3", "s3a"):
        raise StorageError(
            f"'{url}': conditional writes (a lease) need an S3-compatible store; {protocol(url)}:// has none"
        )
    return {"mode": "create"} if if_absent else {"IfMatch": if_etag or ""}


def write_bytes(url: str, data: bytes, key: str, *, if_absent: bool = False, if_etag: str | None = None) -> str:
    """Write the object `url` in one PUT (atomic: readers see all of it or none); its ETag ("" where the
    store gives none). `if_absent`: only if no object is there; `if_etag`: only if it is still the one
    with that ETag — else `Conflict`. A store's refusal is one line naming `key`."""
    fs, path = filesystem(url, key)
    try:
        out = fs.pipe_file(path, data, **_conditions(url, if_absent, if_etag))
    except (FileExistsError, OSError) as exc:
        if (if_absent or if_etag) and _precondition_failed(exc):
            raise Conflict(f"'{url}' was written by someone else meanwhile") from None
        raise refusal(exc, url, key, fs, path) or exc from None
    return _etag(out)


def read_bytes(url: str, key: str) -> tuple[bytes, str]:
    """(the object's bytes, its ETag as read). FileNotFoundError when there is none; a store's
    refusal is one line naming `key`. The ETag is asked first, so a write between the two makes a
    later `if_etag` write fail rather than pass on stale bytes."""
    fs, path = filesystem(url, key)
    try:
        fs.invalidate_cache(path)
        etag = str(fs.info(path).get("ETag", ""))
        return fs.cat_file(path), etag
    except Exception as exc:
        raise refusal(exc, url, key, fs, path) or exc from None


def listing(url: str, key: str) -> dict[str, int]:
    """Every object under the prefix `url` (one recursive listing, never cached): its name relative to
    the prefix, and its size. {} for a prefix with nothing under it."""
    fs, path = filesystem(url, key)
    root = path.rstrip("/")
    try:
        fs.invalidate_cache(root)
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:
        raise refusal(exc, url, key, fs, path) or exc from None
    return {
        name[len(root) + 1 :]: int(info.get("size") or 0)
        for name, info in sorted(found.items())
        if name.startswith(root + "/") and info.get("type") != "directory"
    }


def remove(urls: list[str], key: str) -> None:
    """Delete the objects `urls`, in this order (an object already gone is no error): callers order
    them so that what makes a prefix count (a COMPLETE.json) goes first."""
    for url in urls:
        fs, path = filesystem(url, key)
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise refusal(exc, url, key, fs, path) or exc from None


def _precondition_failed(exc: BaseException) -> bool:
    # s3fs: If-None-Match failing is FileExistsError; If-Match failing an OSError(EINVAL) caused by boto's
    # ClientError with the code PreconditionFailed (412).
    cause = getattr(exc.__cause__, "response", None) or {}
    return isinstance(exc, FileExistsError) or cause.get("Error", {}).get("Code") in ("PreconditionFailed", "412")


def _etag(put_response: Any) -> str:
    return str(put_response.get("ETag", "")) if isinstance(put_response, dict) else ""
