;;;; Every use of SBCL's metaobject protocol (sb-mop) lives in this file, so
;;;; that the next SBCL breaks in one place.  The engine's request
;;;; constructor (engine/request-object.lisp) asks it what making an instance
;;;; of a class would do, and sets the instance's slots by location.

(in-package #:hunchentoot-recycling-taskmaster)

(defun finalized-class (class)
  "CLASS, its inheritance finalized, so that its slots are known."
  (unless (sb-mop:class-finalized-p class)
    (sb-mop:finalize-inheritance class))
  class)

(defun standard-class-p (class)
  "True when CLASS's metaclass is STANDARD-CLASS, whose instances keep their
slots where SB-MOP:SLOT-DEFINITION-LOCATION says."
  (eq (class-of class) (find-class 'standard-class)))

(defun applicable-methods (generic-function &rest argument-classes)
  "The methods of GENERIC-FUNCTION that apply to arguments of
ARGUMENT-CLASSES, most specific first; :UNKNOWN when that depends on the
arguments themselves (an EQL specializer)."
  (multiple-value-bind (methods definitive)
      (sb-mop:compute-applicable-methods-using-classes generic-function argument-classes)
    (if definitive methods :unknown)))

(defun method-specializer (method)
  "The class METHOD specializes its first argument on (an EQL specializer
object when it is one)."
  (first (sb-mop:method-specializers method)))

(defstruct (instance-slot (:constructor make-instance-slot (name location initargs initform initfunction)))
  "What making an instance does with one of its class's instance-allocated slots."
  (name nil :type symbol :read-only t)
  (location 0 :type fixnum :read-only t)
  (initargs '() :type list :read-only t)
  (initform nil :read-only t)
  ;; The function computing INITFORM, NIL when the slot has none.
  (initfunction nil :type (or null function) :read-only t))

(defun instance-slots (class)
  "The instance-allocated slots of the finalized standard class CLASS, as INSTANCE-SLOTs."
  (loop for slot in (sb-mop:class-slots class)
        when (eq (sb-mop:slot-definition-allocation slot) :instance)
          collect (make-instance-slot (sb-mop:slot-definition-name slot)
                                      (sb-mop:slot-definition-location slot)
                                      (sb-mop:slot-definition-initargs slot)
                                      (sb-mop:slot-definition-initform slot)
                                      (sb-mop:slot-definition-initfunction slot))))

(defmacro instance-slot-value (instance location)
  "The value of INSTANCE's slot at LOCATION (a place)."
  `(sb-mop:standard-instance-access ,instance ,location))
