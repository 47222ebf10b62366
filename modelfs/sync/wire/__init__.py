"""What both ends of a sync share: the wire protocol, names, list carriers, sign-in, TLS pins."""
