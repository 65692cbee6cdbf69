;;;; Acceptor mixins in either order: a mixin with its own
;;;; ACCEPTOR-DISPATCH-REQUEST listed before or after the parallel acceptor
;;;; dispatches exactly as beside Hunchentoot's EASY-ACCEPTOR in the same
;;;; place, the document root answering only where Hunchentoot's would --
;;;; and there by the engine's static-file path.  Also: no method of the
;;;; library is specialized on Hunchentoot's classes alone.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite mixin-order :in all
  :description "Dispatch mixins before and after ours; the document root's place; methods on our classes.")
(in-suite mixin-order)

(defclass greeting-routes (ht:acceptor) ()
  (:documentation "A routing mixin: answers /hello/NAME and passes every
other request on to the next method."))

(defmethod ht:acceptor-dispatch-request ((acceptor greeting-routes) request)
  (let ((path (ht:script-name request)))
    (if (and (> (length path) 7) (string= "/hello/" path :end2 7))
        (format nil "hello ~A" (subseq path 7))
        (call-next-method))))

(defclass whole-application (ht:acceptor) ()
  (:documentation "A mixin that answers every request itself, as Clack's
acceptor hands every request to its application."))

(defmethod ht:acceptor-dispatch-request ((acceptor whole-application) request)
  (format nil "application: ~A" (ht:script-name request)))

(defclass easy-then-greeting (ht:easy-acceptor greeting-routes) ())
(defclass greeting-then-easy (greeting-routes ht:easy-acceptor) ())
(defclass parallel-then-greeting (parallel-easy-acceptor greeting-routes) ())
(defclass greeting-then-parallel (greeting-routes parallel-easy-acceptor) ())
(defclass easy-then-application (ht:easy-acceptor whole-application) ())
(defclass application-then-easy (whole-application ht:easy-acceptor) ())
(defclass parallel-then-application (parallel-easy-acceptor whole-application) ())
(defclass application-then-parallel (whole-application parallel-easy-acceptor) ())

(defun make-document-root ()
  "A fresh folder with page.html and a UTF-8 note.txt."
  (let ((folder (uiop:ensure-directory-pathname
                 (format nil "/tmp/hrt-document-root-~36R/" (random (expt 2 40))))))
    (ensure-directories-exist folder)
    (with-open-file (out (merge-pathnames "page.html" folder) :direction :output :external-format :utf-8)
      (write-string "<p>page</p>" out))
    (with-open-file (out (merge-pathnames "note.txt" folder) :direction :output :external-format :utf-8)
      (write-string "café" out))
    folder))

(defun answer (server path)
  "Status, body and Content-Type of GET PATH from SERVER, and whether the
reply had an ETag (which only SERVE-STATIC-FILE sends)."
  (multiple-value-bind (body status headers)
      (drakma:http-request (url server path) :connection-timeout 10)
    (list status
          (if (stringp body) body (flex:octets-to-string body :external-format :utf-8))
          (cdr (assoc :content-type headers))
          (and (assoc :etag headers) t))))

(defun later-mixin-answer (body)
  "The body and Content-Type Hunchentoot's EASY-ACCEPTOR answers with when
a dispatch method after its own returns the string BODY: Hunchentoot 1.2
drops it (its method ends with FINALLY (CALL-NEXT-METHOD)), 1.3 returns it."
  (if (string< ht:*hunchentoot-version* "1.3")
      (list "" "text/html")
      (list body "text/html; charset=utf-8")))

(defun check-same-dispatch (hunchentoot-class our-class expected)
  "Serve the same document root from an acceptor of HUNCHENTOOT-CLASS and
one of OUR-CLASS; EXPECTED lists (path status body content-type file-p)
as Hunchentoot's answers them (body :ANY: whatever it is).  Ours must answer the same, a file (FILE-P)
with an ETag: the engine sent it."
  (let ((root (make-document-root)))
    (unwind-protect
         (with-thread-leak-check ()
           (with-server (theirs (make-server hunchentoot-class :document-root root))
             (with-server (ours (make-server our-class :document-root root))
               (loop for (path status body content-type file-p) in expected
                     for their-answer = (answer theirs path)
                     for our-answer = (answer ours path)
                     for compared = (if (eq body :any) '(0 2) '(0 1 2))
                     do (is (equal (list status (if (eq body :any) (second their-answer) body) content-type)
                                   (subseq their-answer 0 3))
                            "~A: ~A answers ~S" hunchentoot-class path their-answer)
                        ;; An error page names the port.
                        (is (equal (mapcar (lambda (i) (nth i their-answer)) compared)
                                   (mapcar (lambda (i) (nth i our-answer)) compared))
                            "~A: ~A answers ~S where ~A answers ~S"
                            our-class path our-answer hunchentoot-class their-answer)
                        (when file-p
                          (is (fourth our-answer) "~A: ~A was not sent by the engine's file path"
                              our-class path))))))
      (uiop:delete-directory-tree root :validate t))))

(defun greeting-answers (greeting)
  "GREETING: the body and Content-Type of /hello/alice."
  `(("/hello/alice" 200 ,@greeting nil)
    ("/test/yo" 200 "Hey!" "text/plain; charset=utf-8" nil)
    ("/page.html" 200 "<p>page</p>" "text/html; charset=utf-8" t)
    ("/note.txt" 200 "café" "text/plain; charset=utf-8" t)
    ("/missing.html" 404 :any "text/html; charset=iso-8859-1" nil)))

(test mixin-order.routes-mixin-after-ours-keeps-its-routes
  (check-same-dispatch 'easy-then-greeting 'parallel-then-greeting
                       (greeting-answers (later-mixin-answer "hello alice"))))

(test mixin-order.routes-mixin-before-ours-keeps-its-routes
  (check-same-dispatch 'greeting-then-easy 'greeting-then-parallel
                       (greeting-answers '("hello alice" "text/html; charset=utf-8"))))

(test mixin-order.application-mixin-after-ours-answers-every-path
  (check-same-dispatch 'easy-then-application 'parallel-then-application
                       `(("/" 200 ,@(later-mixin-answer "application: /") nil)
                         ("/page.html" 200 ,@(later-mixin-answer "application: /page.html") nil)
                         ("/test/yo" 200 "Hey!" "text/plain; charset=utf-8" nil))))

(test mixin-order.application-mixin-before-ours-answers-every-path
  ;; Listed first, its method runs before the easy handlers'.
  (check-same-dispatch 'application-then-easy 'application-then-parallel
                       '(("/" 200 "application: /" "text/html; charset=utf-8" nil)
                         ("/page.html" 200 "application: /page.html" "text/html; charset=utf-8" nil)
                         ("/test/yo" 200 "application: /test/yo" "text/html; charset=utf-8" nil))))

(defun add-intercepting-method (qualifiers path answer)
  "Define, as a user would while a server runs, an ACCEPTOR-DISPATCH-REQUEST
method with QUALIFIERS on PARALLEL-THEN-GREETING that answers PATH with
ANSWER and passes every other request on; the method."
  (eval `(defmethod ht:acceptor-dispatch-request ,@qualifiers ((acceptor parallel-then-greeting) request)
           (if (equal (ht:script-name request) ,path)
               ,answer
               (call-next-method)))))

(test mixin-order.dispatch-method-added-while-serving-is-seen
  ;; The document root's place in the chain is kept until the generic
  ;; function's methods change: a method defined while the server runs
  ;; counts from its next request, as on Hunchentoot's acceptor.
  (let ((root (make-document-root))
        (methods '()))
    (unwind-protect
         (with-server (server (make-server 'parallel-then-greeting :document-root root))
           (is (equal '(200 "<p>page</p>") (subseq (answer server "/page.html") 0 2)))
           (push (add-intercepting-method '(:around) "/page.html" "intercepted") methods)
           (is (equal '(200 "intercepted") (subseq (answer server "/page.html") 0 2)))
           (push (add-intercepting-method '() "/note.txt" "primary") methods)
           (is (equal '(200 "primary") (subseq (answer server "/note.txt") 0 2)))
           (is (equal `(200 ,(first (later-mixin-answer "hello bob")))
                      (subseq (answer server "/hello/bob") 0 2)))
           (remove-method #'ht:acceptor-dispatch-request (pop methods))
           (is (equal '(200 "café") (subseq (answer server "/note.txt") 0 2))
               "and a method removed is gone from the chain"))
      (dolist (method methods)
        (remove-method #'ht:acceptor-dispatch-request method))
      (uiop:delete-directory-tree root :validate t))))

;;; The library's methods on generic functions of others.

(defun library-source-p (pathname)
  "True when PATHNAME is one of the library's own source files."
  (let ((source (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster" "src/")))
    (and pathname
         (probe-file pathname)
         (uiop:subpathp (truename pathname) (truename source)))))

(defun library-methods ()
  "Every method whose definition is in the library's source, with its
generic function's name."
  (let ((methods '())
        (seen (make-hash-table :test 'eq)))
    (flet ((visit (function-name)
             (when (fboundp function-name)
               (let ((function (fdefinition function-name)))
                 (when (and (typep function 'generic-function) (not (gethash function seen)))
                   (setf (gethash function seen) t)
                   (dolist (method (sb-mop:generic-function-methods function))
                     (let ((source (ignore-errors (sb-introspect:find-definition-source method))))
                       (when (and source
                                  (library-source-p (sb-introspect:definition-source-pathname source)))
                         (push (cons function-name method) methods)))))))))
      (do-all-symbols (symbol)
        (visit symbol)
        (visit `(setf ,symbol))))
    methods))

(defun library-symbol-p (symbol)
  "True for the symbols of the library's packages: its own and its websocket API's."
  (member (symbol-package symbol) (list (find-package '#:hunchentoot-recycling-taskmaster)
                                        (find-package '#:hunchentoot-recycling-websocket))))

(defun library-class-p (specializer)
  (and (typep specializer 'class)
       (library-symbol-p (class-name specializer))))

(defun library-generic-function-p (name)
  (library-symbol-p (if (consp name) (second name) name)))

(test library.no-method-on-hunchentoot-classes-alone
  ;; Stricter than "not all Hunchentoot's classes": a method on another
  ;; library's generic function has a class of ours among its specializers,
  ;; so that it can apply only to our objects.
  (let ((methods (library-methods)))
    (is (find-if (lambda (entry) (eq (car entry) 'ht:process-request)) methods)
        "the library's methods are found (its PROCESS-REQUEST among them)")
    (loop for (name . method) in methods
          for specializers = (sb-mop:method-specializers method)
          unless (library-generic-function-p name)
            do (is (some #'library-class-p specializers)
                   "~S ~S has no class of the library among its specializers: it applies beyond our objects"
                   name (mapcar (lambda (specializer)
                                  (if (typep specializer 'class) (class-name specializer) specializer))
                                specializers)))))
