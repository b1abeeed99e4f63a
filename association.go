package outbox

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"
)

// gorm.G's association updates. Set(clause.Association{Type:
// clause.OpUpdate}) on a many-to-many association makes GORM update the
// associated rows through Table(<their table>) without a model: an UPDATE
// of that table whose WHERE keeps the rows an EXISTS over the join table
// links to the owners. The statement names tables only, so the plugin
// finds the associated model where GORM has just put it, parsing the
// owner's association: GORM's cache of parsed schemas. Other writes
// without a model (Table(...), Exec) stay unseen (docs/writing.md).

// associationModel returns the emitting model whose rows stmt updates,
// when stmt is GORM's update of a many-to-many association's rows, and
// nil otherwise: for any other statement without a model, and for an
// associated model that does not emit. It fails, before anything is
// written, when it cannot tell.
func (p *OutboxPlugin) associationModel(stmt *gorm.Statement) (*schema.Schema, error) {
	table, ok := associationUpdate(stmt)
	if !ok {
		return nil, nil
	}
	refuse := func(why string) error {
		return fmt.Errorf("%w: gorm.G's update of the rows of a many-to-many association (table %s) runs without a model, and %s; update the rows through their model instead, for example gorm.G[Model](db).Where(\"id IN (?)\", <the ids from the join table>).Updates(ctx, ...)",
			ErrUnidentifiedRows, stmt.Table, why)
	}
	cache, ok := schemaCache(stmt.DB)
	if !ok {
		return nil, refuse("the plugin cannot read which model has that table")
	}
	// One model may be cached more than once (under a table name given
	// with Table(...), as well); it counts once.
	var emitting []*schema.Schema
	cache.Range(func(_, v any) bool {
		s, ok := v.(*schema.Schema)
		if !ok || s.Table != table || p.emitterFor(s.ModelType) == nil {
			return true
		}
		if !slices.ContainsFunc(emitting, func(e *schema.Schema) bool { return e.ModelType == s.ModelType }) {
			emitting = append(emitting, s)
		}
		return true
	})
	switch len(emitting) {
	case 0:
		return nil, nil
	case 1:
		return emitting[0], nil
	}
	return nil, refuse("more than one model that emits events has that table")
}

// associationUpdate reports whether stmt is an update without a model,
// of values from a map, whose WHERE keeps the rows of its table that an
// EXISTS over another table correlates with them: the statement GORM runs
// for gorm.G's association update of a many-to-many association. It
// returns the table's name as the associated model's schema gives it:
// GORM's Table keeps only the part after a schema's name ("app.tags"
// becomes "tags") in stmt.Table, the correlation the whole name.
func associationUpdate(stmt *gorm.Statement) (string, bool) {
	if stmt.Schema != nil || stmt.Table == "" {
		return "", false
	}
	if _, ok := stmt.Dest.(map[string]any); !ok {
		return "", false
	}
	where, _ := stmt.Clauses["WHERE"].Expression.(clause.Where)
	for _, e := range where.Exprs {
		x, ok := e.(clause.Expr)
		if !ok || x.SQL != "EXISTS (?)" || len(x.Vars) != 1 {
			continue
		}
		sub, ok := x.Vars[0].(*gorm.DB)
		if !ok || sub.Statement == nil {
			continue
		}
		inner, _ := sub.Statement.Clauses["WHERE"].Expression.(clause.Where)
		for _, ie := range inner.Exprs {
			eq, ok := ie.(clause.Eq)
			if !ok {
				continue
			}
			own, ok1 := eq.Column.(clause.Column)
			other, ok2 := eq.Value.(clause.Column)
			if ok1 && ok2 && named(own.Table, sub.Statement.Table) && named(other.Table, stmt.Table) {
				return other.Table, true
			}
		}
	}
	return "", false
}

// named reports whether a schema's table name (with a schema's name
// before it, or not) names the table a statement's Table holds.
func named(schemaTable, stmtTable string) bool {
	return schemaTable == stmtTable || strings.HasSuffix(schemaTable, "."+stmtTable)
}

// schemaCache returns GORM's cache of the schemas parsed for db, which
// gorm.Config keeps unexported (cacheStore, GORM v1.31); false when it
// has no such field.
func schemaCache(db *gorm.DB) (*sync.Map, bool) {
	f := reflect.ValueOf(db.Config).Elem().FieldByName("cacheStore")
	if !f.IsValid() || f.Type() != reflect.TypeFor[*sync.Map]() {
		return nil, false
	}
	m := *(**sync.Map)(unsafe.Pointer(f.UnsafeAddr()))
	return m, m != nil
}
