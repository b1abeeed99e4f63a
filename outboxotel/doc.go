// Package outboxotel traces and measures outbox delivery with
// OpenTelemetry, and carries the writer's trace context to the consumer.
//
// # Trace context, from the writer to the consumer
//
// [TraceHeaders] is the W3C trace context of a context as headers. Given
// to the plugin with outbox.WithContextHeaders, it stores the writer's
// traceparent (and tracestate) with every event written inside a span:
//
//	db.Use(outbox.Plugin(outbox.WithContextHeaders(outboxotel.TraceHeaders)))
//	db.WithContext(ctx).Create(&order) // the event's headers hold ctx's traceparent
//
// [Wrap] puts a publisher under a span per batch. That span is a producer
// span of the messaging semantic conventions, in a trace of its own (the
// dispatcher works for no single request), linked to the stored trace
// context of each message of the batch. The messages reach the wrapped
// publisher with their headers unchanged, traceparent included, so that a
// publisher that puts the headers on the wire (outboxhttp sends them in
// each message of the JSON body) lets the consumer continue the writer's
// trace.
//
//	d, err := outbox.NewDispatcher(db, outboxotel.Wrap(publisher))
//
// The trace context is read and written through the global propagator
// (otel.GetTextMapPropagator); while none is set (the global one then
// propagates nothing), through the W3C Trace Context propagator.
//
// # Metrics
//
// Wrap also records, through the OpenTelemetry metric API, the metrics of
// the outboxprom package under the same names, for programs that export
// OTLP rather than being scraped: outbox_published_total (event_type,
// outcome), outbox_publish_duration_seconds, outbox_batch_messages and
// outbox_commit_to_accept_seconds; [Watch] adds the gauges outbox_messages
// (state) and outbox_oldest_due_age_seconds, read from
// [outbox.Dispatcher.Stats] at collection time. Names, attributes and
// their values are stable and mean what the outboxprom documentation says.
package outboxotel
