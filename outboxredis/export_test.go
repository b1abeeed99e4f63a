package outboxredis

// LimitArgumentBytes makes p treat n as the server's proto-max-bulk-len, so
// that a test can exceed the limit without sending hundreds of megabytes.
func (p *Publisher) LimitArgumentBytes(n int64) { p.maxBytes = n }

// SupportsIDMP exposes the version check to the tests.
var SupportsIDMP = supportsIDMP
