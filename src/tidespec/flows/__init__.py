"""The Prefect flows (thin: each task calls one `tidespec.cycle` step). prefect.yaml points at them
by module path: `tidespec.flows.cycle:tide_cycle`, `tidespec.flows.train:tide_train`."""
