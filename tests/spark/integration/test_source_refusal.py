"""The Spark source reads a live cluster through `LogReader`, from the storage nodes' admin ports:
given an application's (client role) certificate it must stop at once with the node's refusal,
not retry for its whole timeout (issue 34). A `waltz dev up --tls` cluster; planning only (the
driver's cluster view), so no SparkSession is needed."""

from __future__ import annotations

import pathlib
import time

import pytest
from support.dev_cluster import dev_cluster
from waltz import errors
from waltz.spark.options import Options
from waltz.spark.source import _view_or_low_water_marks

pytestmark = pytest.mark.spark


def test_a_refused_certificate_fails_the_plan_at_once(tmp_path: pathlib.Path) -> None:
    with dev_cluster(tmp_path / "dev", partitions=2, tls=True) as up:
        env = up["environment"]
        certs = pathlib.Path(env["WALTZ_TLS_CERT"]).parent

        def options(role: str) -> Options:
            return Options.parse(
                {
                    "metadata": env["WALTZ_METADATA"],
                    "cluster": env["WALTZ_CLUSTER"],
                    "tlsCa": str(certs / "ca.pem"),
                    "tlsCert": str(certs / f"{role}.pem"),
                    "tlsKey": str(certs / f"{role}-key.pem"),
                    "timeout": "30",
                }
            )

        view = _view_or_low_water_marks(options("admin"))
        assert view is not None and set(view.high_water_marks) == {0, 1}
        started = time.monotonic()
        with pytest.raises(errors.RefusedError, match="has role client; this port admits only server, admin"):
            _view_or_low_water_marks(options("client"))
        assert time.monotonic() - started < 15
