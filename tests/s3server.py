"""A real S3 protocol server for the tests: moto's server mode in a process of its own, on loopback, on a
free port, with IAM checks on — wrong credentials are refused as a real store refuses them.

`S3Server.start()` gives the endpoint, a bucket and a user's credentials; `server.env` is what a process
needs to find them exactly as it would a real store (boto's usual variables), handed to dtrain and its
torchrun workers through `helpers.env(**server.env)`. Nothing here patches fsspec, s3fs or boto.

Run as a script, this module is that server process: it prints its port, then serves until its standard
input closes (the test session ending, or dying, ends it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION = "us-east-1"
BUCKET = "dtrain-test"


@dataclass
class S3Server:
    process: subprocess.Popen
    endpoint: str
    bucket: str
    key: str
    secret: str
    log: Path
    # Where boto would otherwise look (the developer's ~/.aws; an EC2 metadata address off this machine).
    isolation: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, scratch: Path) -> S3Server:
        log = scratch / "requests.log"  # werkzeug's line per request: method, path, status (206: a range)
        with open(log, "w") as requests_log:
            process = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=requests_log,
                text=True,
            )
        assert process.stdout is not None
        port = process.stdout.readline().strip()
        if not port.isdigit():
            process.kill()
            raise RuntimeError(f"moto's S3 server did not start (it said {port!r})")
        endpoint = f"http://127.0.0.1:{port}"
        isolation = {
            "AWS_CONFIG_FILE": str(scratch / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        key, secret = _create_user_and_bucket(endpoint)
        return cls(process, endpoint, BUCKET, key, secret, log, isolation)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def env(self) -> dict[str, str]:
        """boto's usual environment for this store: what a user's job would have."""
        return {
            **self.isolation,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
        }

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path with query, status) of every request the server answered so far."""
        import re

        text = re.sub(r"\x1b\[[\d;]*m", "", self.log.read_text())  # werkzeug colours some lines
        lines = re.findall(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})', text)
        return [(method, path, int(status)) for method, path, status in lines]

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def filesystem(self) -> Any:
        """An s3fs filesystem for the test itself (uploads, listings), with these credentials."""
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key,
            secret=self.secret,
            endpoint_url=self.endpoint,
            client_kwargs={"region_name": REGION},
            skip_instance_cache=True,
        )

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file of `folder` under `prefix`, as `aws s3 cp --recursive` would; the prefix's URL."""
        fs = self.filesystem()
        for path in sorted(folder.iterdir()):
            if path.is_file():
                fs.pipe_file(f"{self.bucket}/{prefix}/{path.name}", path.read_bytes())
        return self.url(prefix)


def _create_user_and_bucket(endpoint: str) -> tuple[str, str]:
    """An IAM user allowed s3:*, its access key and the bucket; then the server checks every request's
    signature against the users it knows (moto's reset-auth: no request goes unchecked from here on)."""
    import boto3
    import requests

    session = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup", region_name=REGION)
    iam = session.client("iam", endpoint_url=endpoint)
    iam.create_user(UserName="dtrain")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="dtrain", PolicyName="s3", PolicyDocument=json.dumps(policy))
    access = iam.create_access_key(UserName="dtrain")["AccessKey"]
    session.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    return access["AccessKeyId"], access["SecretAccessKey"]


def _serve() -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()  # until the test session closes it (or dies)
    server.stop()


if __name__ == "__main__":
    _serve()
