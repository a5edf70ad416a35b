from kv_sidecar.cli import main

raise SystemExit(main())
