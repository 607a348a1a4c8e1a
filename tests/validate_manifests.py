"""Validate YAML manifests against the openAPIV3Schema of real CRDs.

Usage: validate_manifests.py CRD_DIR MANIFEST...
Checks every field against the schema of the manifest's kind (types, enums,
required fields, no unknown fields unless the schema preserves them) and
exits non-zero naming each violation by its path.

Beyond the schemas, what JobSet's validating webhook refuses and a schema
cannot say: a JobSet failure policy rule's name (in a runtime's JobSet
template) starts with a letter and has only letters, digits and '_,:'
(sigs.k8s.io/jobset v0.12 pkg/webhooks/jobset_webhook.go, found refused by
the real webhook in tests/cluster.sh's cluster).
"""
import re
import sys

import yaml


def load_crds(crd_dir):
    import glob
    import os
    schemas = {}
    for path in glob.glob(os.path.join(crd_dir, "*.yaml")):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
                for v in doc["spec"]["versions"]:
                    schemas[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return schemas


TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def check(value, schema, path, errors):
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            errors.append(f"{path}: expected int or string, got {value!r}")
        return
    t = schema.get("type")
    if t == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: expected integer, got {value!r}")
    elif t == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            errors.append(f"{path}: expected number, got {value!r}")
    elif t in TYPES and not isinstance(value, TYPES[t]):
        errors.append(f"{path}: expected {t}, got {type(value).__name__}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for req in schema.get("required", []):
            if req not in value:
                errors.append(f"{path}: missing required field {req}")
        for k, v in value.items():
            if k in props:
                check(v, props[k], f"{path}.{k}", errors)
            elif isinstance(schema.get("additionalProperties"), dict):
                check(v, schema["additionalProperties"], f"{path}.{k}", errors)
            elif not (schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("additionalProperties") is True
                      or (path.endswith(".metadata") and not props)):
                errors.append(f"{path}: unknown field {k}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check(item, schema["items"], f"{path}[{i}]", errors)


# Kubernetes' own kinds a runtime file may carry beside its runtime (RBAC for
# the in-place restart agent, its admission policy).
BUILT_IN = {
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"),
}

RULE_NAME = re.compile(r"[a-zA-Z]([a-zA-Z0-9_,:]*[a-zA-Z0-9_])?")


def check_jobset_rules(doc, errors):
    spec = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        name = rule.get("name", "")
        if not RULE_NAME.fullmatch(name):
            errors.append(f"{doc['kind']}.spec.template.spec.failurePolicy.rules[{i}].name: {name!r} is refused by "
                          "JobSet's webhook (a letter first, then letters, digits and '_,:' only)")


def main():
    schemas = load_crds(sys.argv[1])
    failed = False
    for path in sys.argv[2:]:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                key = (doc.get("apiVersion"), doc.get("kind"))
                if key in BUILT_IN:
                    # Not a CRD: the real API server checks it (tests/it/cluster.rs applies every runtime).
                    print(f"{path}: {doc['kind']} {doc['metadata']['name']} built in, left to the API server")
                    continue
                if key not in schemas:
                    print(f"{path}: no CRD for {key}")
                    failed = True
                    continue
                errors = []
                check(doc, schemas[key], doc["kind"], errors)
                if doc["kind"] in ("ClusterTrainingRuntime", "TrainingRuntime"):
                    check_jobset_rules(doc, errors)
                for e in errors:
                    print(f"{path}: {e}")
                failed = failed or bool(errors)
                if not errors:
                    print(f"{path}: {doc['kind']} {doc['metadata']['name']} valid")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
