#!/bin/sh
# A host discovery script for horarun --host-discovery-script: it prints the hosts the elastic
# job may use now, one per line, as "host" or "host:slots". horarun runs it every second.
#
# With HORA_EXAMPLE_HOSTS naming a file, it prints that file (edit the file while the job runs
# to add or remove hosts); otherwise three loopback addresses of this machine, which horarun
# treats as three hosts that it reaches without SSH.
if [ -n "$HORA_EXAMPLE_HOSTS" ] && [ -f "$HORA_EXAMPLE_HOSTS" ]; then
    cat "$HORA_EXAMPLE_HOSTS"
else
    printf '127.0.0.1\n127.0.0.2\n127.0.0.3\n'
fi
