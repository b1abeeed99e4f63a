package outbox

import (
	"context"
	"fmt"
	"maps"
)

// WithContextHeaders makes the plugin add headers taken from the writing
// statement's context to every event it writes: fn is called with the
// context of the statement (db.WithContext(ctx)) once per write of events,
// by the plugin's callbacks and by [Publish], and what it returns is merged
// into each event's Headers. An event's own header wins over a context
// header of the same name; the Event values and Headers maps given by the
// caller are never modified.
//
// Use it for trace context (outboxotel.TraceHeaders stores the writer's
// W3C traceparent), tenant or request ids. Given more than once, every fn
// applies, in order, a later one winning a name over an earlier one. fn
// may return nil (no headers); the headers it returns are validated like
// the event's own, so a name or value that is not valid UTF-8 or holds a
// NUL fails the write with [ErrInvalidEvent]. fn must not be nil.
//
// Default: none, events carry only their own headers.
func WithContextHeaders(fn func(ctx context.Context) map[string]string) Option {
	return func(p *OutboxPlugin) error {
		if fn == nil {
			return fmt.Errorf("%w: WithContextHeaders: nil function", ErrInvalidOption)
		}
		p.contextHeaders = append(p.contextHeaders, fn)
		return nil
	}
}

// contextHeadersFunc is the function given to WithContextHeaders.
type contextHeadersFunc = func(ctx context.Context) map[string]string

// withContextHeaders returns events with the headers of ctx merged in, as
// WithContextHeaders says; events itself when there are none to merge.
func (p *OutboxPlugin) withContextHeaders(ctx context.Context, events []Event) []Event {
	if len(p.contextHeaders) == 0 || ctx == nil {
		return events
	}
	var extra map[string]string
	for _, fn := range p.contextHeaders {
		h := fn(ctx)
		if len(h) == 0 {
			continue
		}
		if extra == nil {
			extra = make(map[string]string, len(h))
		}
		maps.Copy(extra, h)
	}
	if len(extra) == 0 {
		return events
	}
	out := make([]Event, len(events))
	for i, e := range events {
		h := make(map[string]string, len(extra)+len(e.Headers))
		maps.Copy(h, extra)
		maps.Copy(h, e.Headers)
		e.Headers = h
		out[i] = e
	}
	return out
}
