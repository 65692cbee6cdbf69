;;;; Every use of SBCL's metaobject protocol (sb-mop) lives in this file, so
;;;; that the next SBCL breaks in one place.  The engine's request
;;;; constructor (engine/http/request-object.lisp) asks it what making an instance
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

(defun default-initarg-function (class slot)
  "The function computing the default initarg of the finalized CLASS that
fills SLOT, an INSTANCE-SLOT, when MAKE-INSTANCE is given none of its
initargs; NIL when no default initarg of CLASS names one."
  (loop for (initarg nil function) in (sb-mop:class-default-initargs class)
        when (member initarg (instance-slot-initargs slot))
          return function))

(defmacro instance-slot-value (instance location)
  "The value of INSTANCE's slot at LOCATION (a place)."
  `(sb-mop:standard-instance-access ,instance ,location))

;;; Running the rest of a generic function's primary methods with one of
;;; them replaced (the document root, document-root.lisp, takes the place of
;;; Hunchentoot's last ACCEPTOR-DISPATCH-REQUEST method wherever a mixin
;;; puts it in the chain).

(defun primary-methods-after (method generic-function arguments)
  "The primary methods of GENERIC-FUNCTION that CALL-NEXT-METHOD in METHOD
runs for ARGUMENTS, in the order it runs them."
  (rest (member method (remove-if #'sb-mop:method-qualifiers
                                  (sb-mop:compute-applicable-methods-using-classes
                                   generic-function (mapcar #'class-of arguments))))))

(sb-ext:define-load-time-global **generic-function-methods-location**
  (sb-mop:slot-definition-location
   (find 'sb-pcl::methods (sb-mop:class-slots (finalized-class (find-class 'standard-generic-function)))
         :key #'sb-mop:slot-definition-name))
  "Where a STANDARD-GENERIC-FUNCTION keeps the list SB-MOP:GENERIC-FUNCTION-METHODS reads.")

(defun generic-function-methods-list (generic-function)
  "GENERIC-FUNCTION's list of methods: a fresh list each time a method is
added or removed, so that a chain computed from it can be kept until the
list changes.  Workers ask it several times a request: for a
STANDARD-GENERIC-FUNCTION it is read from its slot, without the generic
reader's dispatch (11 ns against 4, warm)."
  (if (eq (class-of generic-function) (load-time-value (find-class 'standard-generic-function) t))
      (sb-mop:funcallable-standard-instance-access generic-function **generic-function-methods-location**)
      (sb-mop:generic-function-methods generic-function)))

(defun make-replacing-method (lambda-list function)
  "A primary method, in no generic function, that calls FUNCTION with its
arguments and ignores the methods after it."
  (make-instance 'standard-method
                 :qualifiers '()
                 :lambda-list lambda-list
                 :specializers (mapcar (constantly (find-class t)) lambda-list)
                 :function (lambda (arguments next-methods)
                             (declare (ignore next-methods))
                             (apply function arguments))))

(defun call-method-chain (methods arguments)
  "Run the primary METHODS on ARGUMENTS as CALL-NEXT-METHOD runs them: the
first, with the rest as its next methods."
  (funcall (sb-mop:method-function (first methods)) arguments (rest methods)))
