package cloudevent

import (
	"regexp"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
)

func TestAttributesNameEveryRequiredAttributeAndTheAggregate(t *testing.T) {
	m := outbox.Message{EventID: "e1", EventType: "order.created", AggregateType: "order",
		AggregateID: "42", Sequence: 7, OccurredAt: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.FixedZone("x", 3600))}
	got := map[string]string{}
	name := regexp.MustCompile(`^[a-z0-9]{1,20}$`)
	for _, a := range Attributes(m, "") {
		if !name.MatchString(a.Name) {
			t.Errorf("attribute name %q is not lower-case letters and digits", a.Name)
		}
		got[a.Name] = a.Value
	}
	want := map[string]string{"id": "e1", "source": DefaultSource, "specversion": "1.0",
		"type": "order.created", "time": "2026-01-02T02:04:05.000006Z", "subject": "order/42",
		"datacontenttype": "application/json", "partitionkey": "order/42",
		"aggregatetype": "order", "aggregateid": "42", "aggregatesequence": "7"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("got %d attributes, want %d: %v", len(got), len(want), got)
	}
}

func TestAttributesUseTheGivenSource(t *testing.T) {
	for _, a := range Attributes(outbox.Message{}, "/orders") {
		if a.Name == "source" && a.Value != "/orders" {
			t.Fatalf("source = %q, want /orders", a.Value)
		}
	}
}

func TestCheckSourceAcceptsURIReferencesOnly(t *testing.T) {
	for source, ok := range map[string]bool{
		"gorm-outbox":                 true,
		"/shop/orders":                true,
		"https://shop.example/orders": true,
		"urn:uuid:6e8bc430-9c3a-11d9": true,
		"":                            false,
		"my app":                      false,
		"tab\there":                   false,
		"nul\x00":                     false,
		"del\x7f":                     false,
		"%zz":                         false,
	} {
		if err := CheckSource(source); (err == nil) != ok {
			t.Errorf("CheckSource(%q) = %v, want ok %v", source, err, ok)
		}
	}
}
