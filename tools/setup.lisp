;;;; Loaded first by every make target: ASDF, and this checkout as a place
;;;; to find systems, besides Debian's /usr/share/common-lisp.
;;;;
;;;; HUNCHENTOOT in the environment names another Hunchentoot's source
;;;; folder (the one holding hunchentoot.asd), found ahead of Debian's; its
;;;; fasls, and ours compiled against it, go to a cache folder of its own,
;;;; so that fasls built against one Hunchentoot never load with another.

(require :asdf)

(defun hunchentoot-override ()
  "The folder HUNCHENTOOT names, as a directory pathname, or NIL when unset."
  (let ((folder (uiop:getenv "HUNCHENTOOT")))
    (when (and folder (plusp (length folder)))
      (let ((directory (uiop:ensure-directory-pathname (uiop:parse-native-namestring folder))))
        (unless (probe-file (merge-pathnames "hunchentoot.asd" directory))
          (format *error-output* "~&HUNCHENTOOT=~A has no hunchentoot.asd: it must name a Hunchentoot ~
                                  source folder (../shared/vendor/hunchentoot-1.3.1, for example).~%"
                  folder)
          (uiop:quit 2))
        (truename directory)))))

(defparameter *checkout*
  (uiop:pathname-parent-directory-pathname (uiop:pathname-directory-pathname *load-truename*))
  "This checkout's folder.")

(defun find-systems-in (&rest folders)
  "Let ASDF find systems in FOLDERS first, then in HUNCHENTOOT's folder, this
checkout and Debian's."
  (let ((hunchentoot (hunchentoot-override)))
    (asdf:initialize-source-registry
     `(:source-registry
       ,@(loop for folder in folders collect `(:directory ,folder))
       ,@(when hunchentoot `((:directory ,hunchentoot)))
       (:directory ,*checkout*)
       :inherit-configuration))))

(find-systems-in)

(let ((hunchentoot (hunchentoot-override)))
  (when hunchentoot
    (asdf:initialize-output-translations
     `(:output-translations
       (t (,(uiop:xdg-cache-home "common-lisp" "hunchentoot-recycling-taskmaster"
                                 (format nil "~{~A~^-~}/" (rest (pathname-directory hunchentoot))))
           :implementation :**/ :*.*.*))
       :inherit-configuration))
    (format t "~&;; Hunchentoot from ~A~%" hunchentoot)))

;;; Quiet compilation, as Quicklisp's: a first run compiles every dependency,
;;; whose file names, compiler notes and warnings are not the user's to
;;; read.  This checkout's own files are compiled without their names and
;;; notes, but with every warning shown.  The file names are turned off
;;; globally: ASDF's own PERFORM :AROUND method binds the compiler's
;;; verbosity again from the values it finds at the start of an operation.

(setf *compile-verbose* nil
      *compile-print* nil)

(defun this-checkout-component-p (component)
  "True when COMPONENT is a file of this checkout's systems."
  (let ((path (asdf:component-pathname component)))
    (and path (uiop:subpathp path *checkout*))))

(defun call-quietly (component function)
  "Call FUNCTION, which compiles or loads COMPONENT, without compiler notes,
and without the warnings of a component that is not this checkout's.  Such
a component is compiled in a compilation unit of its own: SBCL reports an
undefined variable or function at the end of the unit, which would
otherwise come after every component, out of reach of this handler."
  (let ((ours (this-checkout-component-p component)))
    (handler-bind ((sb-ext:compiler-note #'muffle-warning)
                   (warning (lambda (condition)
                              (unless ours
                                (muffle-warning condition)))))
      (if ours
          (funcall function)
          (with-compilation-unit (:override t)
            (funcall function))))))

;;; Around PERFORM-WITH-RESTARTS, not PERFORM: asdf-flv, which fiveam loads,
;;; defines PERFORM :AROUND methods on these very classes, which replaced
;;; ours as it loaded, and every later dependency compiled aloud (2,833
;;; lines before the first test of a first `make test`).

(defmethod asdf:perform-with-restarts :around ((operation asdf:compile-op) (component asdf:cl-source-file))
  (call-quietly component #'call-next-method))

(defmethod asdf:perform-with-restarts :around ((operation asdf:load-op) (component asdf:cl-source-file))
  (call-quietly component #'call-next-method))

(defun load-systems-quietly (&rest systems)
  "Load SYSTEMS as ASDF:LOAD-SYSTEM does, without what ASDF says of other
projects' system definition files (Debian's hold secondary systems ASDF
warns about)."
  (handler-bind ((asdf/parse-defsystem:bad-system-name #'muffle-warning))
    (mapc #'asdf:load-system systems)))
