from kv_sidecar.refengine.engine import main

raise SystemExit(main())
