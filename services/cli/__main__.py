from services.cli.main import main

raise SystemExit(main())
