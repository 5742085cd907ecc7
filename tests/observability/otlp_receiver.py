"""A loopback OTLP/HTTP trace receiver for the tests: decodes every export with the official
`opentelemetry-proto` package and appends one JSON line per span to the file named on the command
line. Prints `listening <port>` once ready. `--hang` accepts requests and never answers (an endpoint
that hangs).

    python otlp_receiver.py SPANS.jsonl [--hang]
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OUT = sys.argv[1]
HANG = "--hang" in sys.argv[2:]
LOCK = threading.Lock()


def value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if HANG:
            time.sleep(3600)
            return
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        lines = []
        for resource_spans in request.resource_spans:
            resource = {a.key: value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(
                        json.dumps(
                            {
                                "service": resource.get("service.name"),
                                "scope": scope_spans.scope.name,
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "status": span.status.code,
                                "duration_ns": span.end_time_unix_nano - span.start_time_unix_nano,
                                "attributes": {a.key: value(a.value) for a in span.attributes},
                                "headers": {
                                    "content-type": self.headers.get("Content-Type"),
                                    "x-test": self.headers.get("x-test"),
                                },
                            }
                        )
                    )
        with LOCK, open(OUT, "a") as out:
            out.writelines(line + "\n" for line in lines)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(f"listening {server.server_address[1]}", flush=True)
server.serve_forever()
