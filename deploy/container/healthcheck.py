"""The image's HEALTHCHECK: GET /health of whichever daemon the container runs (storage node or
server), on the HTTP port its configuration's environment overrides give, else the image's."""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    candidates = [
        (os.environ.get("WALTZ_STORAGE__NODE__HOST"), os.environ.get("WALTZ_STORAGE__NODE__HTTP_PORT", "55282")),
        (os.environ.get("WALTZ_SERVER__SERVER__HOST"), os.environ.get("WALTZ_SERVER__SERVER__HTTP_PORT", "55291")),
    ]
    for host, port in candidates:
        host = "127.0.0.1" if host in (None, "", "0.0.0.0") else host
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=3) as answer:
                print(answer.read().decode(errors="replace"))
                return 0
        except urllib.error.HTTPError as e:  # 503: the daemon answers and is not healthy
            print(e.read().decode(errors="replace"))
            return 1
        except OSError:
            continue  # nothing on this port: the other daemon
    print("no Waltz daemon answers on", ", ".join(f"{h or '127.0.0.1'}:{p}" for h, p in candidates))
    return 1


if __name__ == "__main__":
    sys.exit(main())
