#!/bin/sh
# `pip install` for the image build. Where the build host reaches PyPI through a TLS-intercepting proxy, its CA
# bundle comes in as the BuildKit secret `pip_ca` (docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt):
# mounted for the one RUN only, never stored in a layer. Without the secret pip uses its own CA bundle.
set -e
if [ -s /run/secrets/pip_ca ]; then
  export PIP_CERT=/run/secrets/pip_ca
fi
exec pip install "$@"
