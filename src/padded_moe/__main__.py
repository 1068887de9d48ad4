from padded_moe.cli import main

raise SystemExit(main())
