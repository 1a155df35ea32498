"""`python -m app` behaves exactly like the `expertdesk` command."""

from app.cli import main

raise SystemExit(main())
