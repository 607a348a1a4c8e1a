"""Point a controller's admission webhooks at its process on loopback.

usage: webhooks.py PREFIX URL CA_FILE < manifests.json > webhooks.json

The input is `kubectl create --dry-run=client -o json -f manifests.yaml`
of the controller's own webhook manifests (JSON objects one after the
other, or a List). Each
Mutating/ValidatingWebhookConfiguration is renamed PREFIX-NAME (JobSet's and
Trainer's share their kustomize names) and each webhook's clientConfig, a
Service in the cluster, becomes URL + the service's path, trusted through
CA_FILE: the controllers run as processes here, not as pods behind a
Service. Standard library only.
"""
import base64
import json
import sys

prefix, url, ca_file = sys.argv[1:4]
with open(ca_file, "rb") as f:
    ca = base64.b64encode(f.read()).decode()
# kubectl prints one JSON object per document, one after the other.
text, items, at = sys.stdin.read(), [], 0
decoder = json.JSONDecoder()
while at < len(text):
    if text[at].isspace():
        at += 1
        continue
    doc, at = decoder.raw_decode(text, at)
    items.extend(doc.get("items", []) if doc.get("kind") == "List" else [doc])
out = []
for item in items:
    if item.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        continue
    item["metadata"] = {"name": "%s-%s" % (prefix, item["metadata"]["name"])}
    for hook in item.get("webhooks", []):
        path = hook.get("clientConfig", {}).get("service", {}).get("path", "/")
        hook["clientConfig"] = {"url": url.rstrip("/") + path, "caBundle": ca}
    out.append(item)
if not out:
    sys.exit("webhooks.py: no webhook configuration in the input")
json.dump({"apiVersion": "v1", "kind": "List", "items": out}, sys.stdout)
