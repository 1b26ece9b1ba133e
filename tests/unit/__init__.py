"""Pure tests: no processes, no sockets (session machines, layout, wire, planning, shape)."""
